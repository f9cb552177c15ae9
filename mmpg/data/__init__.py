"""mmpg.data"""
