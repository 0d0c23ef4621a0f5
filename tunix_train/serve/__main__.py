import sys

from tunix_train.serve.cli import main

sys.exit(main(sys.argv[1:]))
