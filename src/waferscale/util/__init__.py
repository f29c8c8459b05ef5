"""Small shared helpers with one home each (the README's Layout names them); a leaf package: imports nothing
from waferscale but `errors`."""
