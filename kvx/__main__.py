"""``python -m kvx``: the kvx command."""

from kvx.cli import main

raise SystemExit(main())
