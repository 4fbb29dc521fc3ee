"""stepwatch: streaming telemetry for large training clusters."""
__version__ = "0.1.0"
