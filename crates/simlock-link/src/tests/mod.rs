//! In-crate tests of the sans-IO core: the [`pair::Pair`] harness, protocol scenarios over it,
//! protocol violations, and the seeded simulation.

pub(crate) mod pair;
pub(crate) mod sim;

mod scenarios;
mod violations;
