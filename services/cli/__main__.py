"""``python -m services.cli``: the ``aikg`` command without its console script."""

from services.cli import main

main()
