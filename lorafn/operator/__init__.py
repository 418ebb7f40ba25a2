"""lorafn.operator"""
