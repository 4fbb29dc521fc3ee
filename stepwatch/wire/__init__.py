"""The wire contract, in one package (docs/wire-format.md): every table, frame, encoder and decoder.

==================  ==========================================================================================
``catalog``         the tables: names, natural keys, time and sort columns, Kafka topics, writers (stdlib only)
``tables``          the Arrow schema of every table, the content types and the value rules (pyarrow)
``encode``          a batch of rows as an Arrow IPC stream or a JSON array, and its headers (what producers
                    and the node agent load: no ``pyarrow.compute``, no validation)
``decode``          the processor's decoder: a message into valid rows and rejections naming field and value
``datagram``        the probe -> agent datagram: its layout, encoder and decoder (stdlib only: the probe
                    imports it)
``columns``         the node agent's columnar reading of the same datagrams into Arrow tables (numpy)
==================  ==========================================================================================

This file imports nothing, so that ``stepwatch.wire.datagram`` costs the probe no more than the standard
library; import the module you need. The layers are import-linter contracts (pyproject.toml).
"""
