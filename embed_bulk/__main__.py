from embed_bulk.cli import main

raise SystemExit(main())
