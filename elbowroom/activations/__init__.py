"""elbowroom.activations"""
