//! What the job's authentication costs at start-up, on loopback: a plain TCP connection with one
//! round trip against a connection to the rendezvous store with its challenge-response handshake
//! (two round trips, HMAC-SHA256 both ways), measured interleaved; and a whole `TcpGroup` of 2 ranks formed through a store (the
//! rendezvous, one handshake per store connection and per pair of ranks). Nothing is added per
//! step: the handshake happens once per connection.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use burn_ddp::comm::auth::{JobIdentity, Role};
use burn_ddp::comm::store::{StoreClient, StoreServer, bind_address};
use burn_ddp::comm::topology::{Topology, TopologySource};
use burn_ddp::group::TcpGroup;
use burn_ddp::group::TcpGroupOptions;
use serde::{Deserialize, Serialize};

/// Medians of the start-up measurements, in milliseconds.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StartupCost {
    /// Samples per measurement.
    pub samples: usize,
    /// A TCP connection and one round trip of one byte to a server thread (the floor).
    pub tcp_connect_ms: f64,
    /// A connection to the store: TCP and the handshake proving the job's key both ways.
    pub store_connect_ms: f64,
    /// A `TcpGroup` of 2 ranks on two threads, from the first call to both groups formed.
    pub group_connect_ms: f64,
}

const TIMEOUT: Duration = Duration::from_secs(30);

fn median_ms(mut samples: Vec<Duration>) -> f64 {
    samples.sort();
    samples
        .get(samples.len() / 2)
        .map_or(0.0, Duration::as_secs_f64)
        * 1e3
}

/// Measures the start-up costs with `samples` samples each.
///
/// # Errors
/// A message when a store, a listener or a group cannot be set up.
pub fn measure(samples: usize) -> Result<StartupCost, String> {
    let job = JobIdentity::new("bench-startup", Some(b"the benchmark's token"))
        .map_err(|e| e.to_string())?;
    let bind = bind_address("127.0.0.1", 0, false).map_err(|e| e.to_string())?;
    let store = StoreServer::bind(bind, &job).map_err(|e| e.to_string())?;
    let store_addr = store.local_addr().to_string();
    let listener = TcpListener::bind(bind).map_err(|e| e.to_string())?;
    let plain = listener.local_addr().map_err(|e| e.to_string())?;
    // Answers one byte on each plain connection: a connection with one round trip to a server
    // thread, as small as a service can be.
    thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            let mut byte = [0u8; 1];
            if stream.read_exact(&mut byte).is_ok() {
                let _ = stream.write_all(&byte);
            }
        }
    });
    let (mut tcp, mut authenticated) = (Vec::new(), Vec::new());
    for _ in 0..samples {
        let started = Instant::now();
        let mut stream = TcpStream::connect(plain).map_err(|e| e.to_string())?;
        let _ = stream.set_nodelay(true);
        let mut byte = [1u8; 1];
        stream
            .write_all(&byte)
            .and_then(|()| stream.read_exact(&mut byte))
            .map_err(|e| e.to_string())?;
        tcp.push(started.elapsed());
        drop(stream);
        let started = Instant::now();
        let client = StoreClient::connect(&store_addr, TIMEOUT, &job, Role::Worker)
            .map_err(|e| e.to_string())?;
        authenticated.push(started.elapsed());
        drop(client);
    }
    let mut groups = Vec::new();
    for _ in 0..samples.div_ceil(4) {
        groups.push(group_of_two(&job, bind)?);
    }
    Ok(StartupCost {
        samples,
        tcp_connect_ms: median_ms(tcp),
        store_connect_ms: median_ms(authenticated),
        group_connect_ms: median_ms(groups),
    })
}

/// Forms a `TcpGroup` of 2 ranks (one thread each) through a fresh store at `bind`.
fn group_of_two(job: &JobIdentity, bind: SocketAddr) -> Result<Duration, String> {
    let store = StoreServer::bind(bind, job).map_err(|e| e.to_string())?;
    let port = store.local_addr().port();
    let topology = |rank| Topology {
        rank,
        world_size: 2,
        local_rank: rank,
        local_world_size: 2,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        agent_store: true,
        restart_count: 0,
        source: TopologySource::Torchrun,
    };
    let options = TcpGroupOptions {
        connect_timeout: TIMEOUT,
        job: Some(job.clone()),
    };
    let started = Instant::now();
    thread::scope(|s| {
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                let (topology, options) = (topology(rank), &options);
                s.spawn(move || TcpGroup::connect(&topology, options).map_err(|e| e.to_string()))
            })
            .collect();
        let formed = ranks
            .into_iter()
            .map(|rank| rank.join().map_err(|_| "a rank panicked".to_string())?)
            .collect::<Result<Vec<TcpGroup>, String>>()?;
        let elapsed = started.elapsed();
        drop(formed);
        Ok(elapsed)
    })
}
