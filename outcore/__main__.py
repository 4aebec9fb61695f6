"""``python -m outcore`` is the ``outcore`` command (useful under ``torchrun -m outcore``)."""

from outcore.app.cli import main

raise SystemExit(main())
