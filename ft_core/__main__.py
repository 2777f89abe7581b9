from ft_core.tools.cli import main

raise SystemExit(main())
