"""lorafn.controller"""
