"""mmpg.eval"""
