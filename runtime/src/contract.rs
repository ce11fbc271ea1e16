//! Topology constants and the CTA-walk rule (seed-design §1.1, §2.4).
