"""elbowroom.plan"""
