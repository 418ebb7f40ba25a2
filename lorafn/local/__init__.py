"""lorafn.local"""
