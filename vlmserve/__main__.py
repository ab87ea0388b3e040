"""`python -m vlmserve ...` is the `vlmserve` command."""

from vlmserve.entrypoints.cli import main

main()
