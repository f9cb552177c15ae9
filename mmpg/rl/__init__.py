"""mmpg.rl"""
