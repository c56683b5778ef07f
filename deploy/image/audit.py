"""The audit image's main application file (a SparkApplication's mainApplicationFile):
`tandem audit` with the arguments spark-submit passes."""

import sys

from tandem.cli import main

sys.exit(main(["audit", *sys.argv[1:]]))
