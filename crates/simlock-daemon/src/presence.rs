//! Live connections by principal, so lease-scoped pushes reach a lease's owner wherever it is
//! connected, and HTTP streams can follow the same notices.

use std::collections::HashMap;
use std::sync::{Arc, Weak};

use parking_lot::Mutex;
use simlock_contract::Push;
use simlock_wire::Connection;
use tokio::sync::broadcast;

/// Notices kept for slow HTTP followers before they miss some.
const NOTICE_BACKLOG: usize = 256;

/// A lease-scoped push and the principal it is for.
#[derive(Debug, Clone)]
pub struct Notice {
    /// The lease owner's principal.
    pub owner: String,
    /// The push.
    pub push: Push,
}

/// The live connections of a daemon, by principal.
#[derive(Clone)]
pub struct Presence {
    connections: Arc<Mutex<HashMap<String, Vec<Weak<Connection>>>>>,
    notices: broadcast::Sender<Notice>,
}

impl Default for Presence {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Presence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Presence")
            .field("principals", &self.connections.lock().len())
            .finish()
    }
}

impl Presence {
    /// Nobody connected.
    pub fn new() -> Self {
        Self {
            connections: Arc::default(),
            notices: broadcast::channel(NOTICE_BACKLOG).0,
        }
    }

    /// Records a greeted connection.
    pub fn add(&self, conn: &Arc<Connection>) {
        let Some(identity) = conn.identity() else {
            return;
        };
        self.connections
            .lock()
            .entry(identity.principal)
            .or_default()
            .push(Arc::downgrade(conn));
    }

    /// Forgets a closed connection.
    pub fn remove(&self, conn: &Arc<Connection>) {
        let Some(identity) = conn.identity() else {
            return;
        };
        let mut map = self.connections.lock();
        if let Some(list) = map.get_mut(&identity.principal) {
            list.retain(|weak| weak.upgrade().is_some_and(|c| c.id() != conn.id()));
            if list.is_empty() {
                map.remove(&identity.principal);
            }
        }
    }

    /// Sends a lease-scoped push to every connection of `owner` except `except` (the connection
    /// releasing the lease itself), and to HTTP followers. Never waits.
    pub fn notify(&self, owner: &str, push: &Push, except: Option<u64>) {
        let targets: Vec<Arc<Connection>> = self
            .connections
            .lock()
            .get(owner)
            .map(|list| list.iter().filter_map(Weak::upgrade).collect())
            .unwrap_or_default();
        for conn in targets {
            if Some(conn.id()) != except {
                conn.push_detached(push);
            }
        }
        let _ = self.notices.send(Notice {
            owner: owner.to_owned(),
            push: push.clone(),
        });
    }

    /// Follows every notice (HTTP lease event streams filter by lease).
    pub fn follow(&self) -> broadcast::Receiver<Notice> {
        self.notices.subscribe()
    }
}
