"""Offline throughput benchmark; see kvstrata/bench/offline.py (also `kvstrata bench offline`)."""
from kvstrata.bench.offline import main

if __name__ == "__main__":
    main()
