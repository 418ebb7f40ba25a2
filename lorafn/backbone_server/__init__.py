"""lorafn.backbone_server"""
