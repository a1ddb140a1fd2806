import sys

try:
    from .cli import main
except KeyboardInterrupt:  # (Ctrl-C while the imports run)
    sys.exit(130)

sys.exit(main())
