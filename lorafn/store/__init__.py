"""lorafn.store"""
