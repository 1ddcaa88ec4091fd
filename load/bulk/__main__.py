from load.bulk.cli import main

raise SystemExit(main())
