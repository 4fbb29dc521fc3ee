"""stepwatch.stream"""
