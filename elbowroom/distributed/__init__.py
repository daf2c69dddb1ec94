"""elbowroom.distributed"""
