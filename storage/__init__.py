"""stepwatch.storage: the Parquet store (:mod:`.store`), its DuckDB views (:mod:`.views`), the canned
queries and their text output (:mod:`.queries`), compaction and retention (:mod:`.compact`)."""
import os

#: the store's root when a command is given no ``--data-dir`` (``$STEPWATCH_DATA_DIR``)
DEFAULT_DATA = os.environ.get("STEPWATCH_DATA_DIR", "./stepwatch-data")
