from worker.ops.cli import main

raise SystemExit(main())
