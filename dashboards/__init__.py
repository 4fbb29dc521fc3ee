"""stepwatch in Grafana (docs/grafana.md): dashboards as code, the DuckDB datasource, alert rules and
alert annotations.

* :mod:`.build` — the dashboards (generated JSON, checked in under ``dashboards/json``);
* :mod:`.datasource` — the ``motherduck-duckdb-datasource`` datasource (initSql = the store's views);
* :mod:`.alerting` — one Grafana-managed alert rule per alert kind over the ``alerts`` view;
* :mod:`.grafana` — :func:`~.grafana.provision` over the HTTP API (grafana-client), idempotent;
* :mod:`.export` — the same as files (ConfigMap-ready) for Helm or file provisioning;
* :mod:`.annotations` — :class:`~.annotations.AnnotationSink`, alerts as annotations, non-blocking;
* :mod:`.cli` — ``stepwatch grafana provision|export`` (:func:`~.cli.register`).

See docs/grafana.md.
"""
