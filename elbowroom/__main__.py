"""``python -m elbowroom`` (and ``torchrun -m elbowroom``): the ``elbowroom`` command."""

import sys

from elbowroom.cli import main

sys.exit(main())
