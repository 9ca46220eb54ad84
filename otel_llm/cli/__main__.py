import sys

from otel_llm.cli import main

if __name__ == "__main__":
    sys.exit(main())
