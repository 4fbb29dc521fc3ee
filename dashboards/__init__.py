"""stepwatch.dashboards"""
