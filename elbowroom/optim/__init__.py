"""elbowroom.optim"""
