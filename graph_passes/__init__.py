"""graph_passes"""
