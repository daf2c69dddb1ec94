"""elbowroom.report"""
