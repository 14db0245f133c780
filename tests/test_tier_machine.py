"""The host tier's stateful property tests (akv.testing.tier_machine): pending copies and metadata mode."""

from akv.testing.tier_machine import SyncTierMachine, TierMachine

TestTierMachine = TierMachine.TestCase
TestSyncTierMachine = SyncTierMachine.TestCase
