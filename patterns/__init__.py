"""patterns"""
