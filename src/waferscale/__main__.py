from waferscale.cli.main import main

raise SystemExit(main())
