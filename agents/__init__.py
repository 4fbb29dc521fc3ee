"""stepwatch.agents"""
