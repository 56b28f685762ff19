"""``python -m nsa``: the nsa command (see nsa._cli)."""
from ._cli import main

main()
