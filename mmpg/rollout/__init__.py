"""mmpg.rollout"""
