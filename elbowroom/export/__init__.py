"""elbowroom.export"""
