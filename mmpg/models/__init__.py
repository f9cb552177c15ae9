"""mmpg.models"""
