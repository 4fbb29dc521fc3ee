"""stepwatch.detectors"""
