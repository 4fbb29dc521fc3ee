"""stepwatch.storage"""
