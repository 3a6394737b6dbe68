"""`python -m fedrec_flwr.cli ...`: the `fedrec` command."""

import sys

from fedrec_flwr.cli.commands import main

main(sys.argv[1:])
