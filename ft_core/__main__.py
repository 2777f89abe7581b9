from ft_core.cli import main

raise SystemExit(main())
