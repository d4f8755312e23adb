from splitspec.cli.main import main

raise SystemExit(main())
