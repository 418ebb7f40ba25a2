"""lorafn.gateway"""
