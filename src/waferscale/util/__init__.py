"""Small shared helpers with one home each (docs/layout.md names them); a leaf package: imports nothing
from waferscale but `errors`."""
