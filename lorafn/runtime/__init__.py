"""lorafn.runtime"""
