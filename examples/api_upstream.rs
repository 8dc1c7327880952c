//! A payments-API-like upstream for `benches/storage.sh`: the bytes a
//! stored record takes, compressed or not, depend on how varied real
//! responses are. A constant body (nginx's `return 201 "{...}"` in
//! `benches/load.sh`) would compress to nearly nothing, a dictionary would
//! hold it whole, and the bench would measure the compressor's best case.
//! Here every response is a realistic object of its own, generated like a
//! Stripe PaymentIntent: random base62 ids, amounts, currencies, names,
//! emails and addresses drawn from small lists, an order id that counts.
//!
//! ```sh
//! cargo run --release --example api_upstream -- 127.0.0.1:PORT [START]
//! ```
//! Any request (POST or GET) to a path starting with `/small` gets `201` and
//! one payment object (about 1.1 KB of compact JSON); `/large` gets `200`
//! and a list of 15 of them (about 16-17 KB), `{"object":"list","data":[...],
//! "has_more":true,"url":"/v1/payment_intents"}`; anything else a `404`.
//! Headers: `content-type: application/json` and `request-id: req_<14>`
//! (hyper adds `date` and `content-length`). The request body is read and
//! dropped.
//!
//! Reproducible: a counter numbers the objects (from START, default 0; a
//! `/large` takes 15 numbers), and each response comes from a
//! `SmallRng` seeded with its first object's number, so two runs from the
//! same START serve the same objects (in the order requests arrive), and
//! runs from START values far apart serve different ones (the dictionary
//! bench trains on one range and measures on another). The order id is
//! `100000 + number`, the creation time moves 3 s per number.
//!
//! One current-thread runtime: the upstream should take little of the
//! machine the proxy is measured on. Nothing is printed per request.

use std::convert::Infallible;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use rand::rngs::SmallRng;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// Objects in a `/large` list.
const LIST_LEN: u64 = 15;

const BASE62: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
const LOWER_ALNUM: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyz";
const FIRST_NAMES: &[&str] = &[
    "Jane", "John", "Amara", "Wei", "Lucas", "Sofia", "Noah", "Priya", "Mateo", "Yuki", "Olga",
    "Kwame",
];
const LAST_NAMES: &[&str] = &[
    "Doe", "Smith", "Okafor", "Chen", "Martin", "Rossi", "Kim", "Patel", "Garcia", "Tanaka",
    "Ivanova", "Mensah",
];
const CITIES: &[(&str, &str, &str)] = &[
    ("Portland", "OR", "97214"),
    ("Austin", "TX", "78701"),
    ("Denver", "CO", "80202"),
    ("Boston", "MA", "02108"),
    ("Seattle", "WA", "98101"),
    ("Chicago", "IL", "60601"),
];
const STREETS: &[&str] = &[
    "SE Hawthorne Blvd",
    "Main St",
    "Congress Ave",
    "Market St",
    "Pine St",
    "Elm Ave",
    "Lake Shore Dr",
];
const CURRENCIES: &[&str] = &["usd", "usd", "usd", "eur", "gbp"];
const AMOUNTS: &[u64] = &[499, 999, 1999, 4999, 12900];

/// `len` characters drawn from `alphabet`, appended to `out`.
fn push_random(out: &mut String, rng: &mut SmallRng, alphabet: &[u8], len: usize) {
    for _ in 0..len {
        out.push(char::from(alphabet[rng.random_range(0..alphabet.len())]));
    }
}

fn random_string(rng: &mut SmallRng, alphabet: &[u8], len: usize) -> String {
    let mut s = String::with_capacity(len);
    push_random(&mut s, rng, alphabet, len);
    s
}

fn pick<'a, T>(rng: &mut SmallRng, items: &'a [T]) -> &'a T {
    items.choose(rng).expect("a non-empty list")
}

/// One payment object, number `i`, appended to `out` as compact JSON in
/// the field order of the API it imitates.
fn payment_intent(out: &mut String, rng: &mut SmallRng, i: u64) {
    let id = random_string(rng, BASE62, 24);
    // One of the usual prices, or any amount (one in six).
    let amount = match rng.random_range(0..=AMOUNTS.len()) {
        k if k < AMOUNTS.len() => AMOUNTS[k],
        _ => rng.random_range(100..500_000),
    };
    let currency = pick(rng, CURRENCIES);
    let secret = random_string(rng, BASE62, 25);
    let created = 1_764_758_400 + i * 3 + rng.random_range(0..3);
    let customer = random_string(rng, BASE62, 14);
    let order = 100_000 + i;
    let items = rng.random_range(1..=5);
    let plural = if items == 1 { "item" } else { "items" };
    let charge = random_string(rng, BASE62, 24);
    let run = random_string(rng, LOWER_ALNUM, 8);
    let call = random_string(rng, BASE62, 7);
    let method = random_string(rng, BASE62, 24);
    let first = pick(rng, FIRST_NAMES);
    let last = pick(rng, LAST_NAMES);
    let email_n = rng.random_range(0..=99);
    let (city, state, postal) = pick(rng, CITIES);
    let house = rng.random_range(1..=9999);
    let street = pick(rng, STREETS);
    let line2 = match rng.random_range(0..3) {
        0 => "null".to_string(),
        1 => format!("\"Apt {}\"", rng.random_range(1..=39)),
        _ => format!("\"Suite {}\"", rng.random_range(100..=899)),
    };
    let status = match rng.random_range(0..10) {
        0..=7 => "succeeded",
        8 => "requires_action",
        _ => "processing",
    };
    let (first_l, last_l) = (first.to_lowercase(), last.to_lowercase());
    // Writing to a String cannot fail.
    let _ = write!(
        out,
        concat!(
            r#"{{"id":"pi_{id}","object":"payment_intent","amount":{amount},"amount_capturable":0,"#,
            r#""amount_received":{amount},"canceled_at":null,"cancellation_reason":null,"#,
            r#""capture_method":"automatic","client_secret":"pi_{id}_secret_{secret}","#,
            r#""confirmation_method":"automatic","created":{created},"currency":"{currency}","#,
            r#""customer":"cus_{customer}","description":"Order #{order} - {items} {plural}","#,
            r#""last_payment_error":null,"latest_charge":"ch_{charge}","livemode":true,"#,
            r#""metadata":{{"order_id":"{order}","agent_run":"run_{run}","tool_call":"call_{call}"}},"#,
            r#""next_action":null,"payment_method":"pm_{method}","#,
            r#""payment_method_options":{{"card":{{"installments":null,"mandate_options":null,"#,
            r#""network":null,"request_three_d_secure":"automatic"}}}},"#,
            r#""payment_method_types":["card"],"receipt_email":"{first_l}.{last_l}{email_n}@example.com","#,
            r#""setup_future_usage":null,"shipping":{{"address":{{"city":"{city}","country":"US","#,
            r#""line1":"{house} {street}","line2":{line2},"postal_code":"{postal}","state":"{state}"}},"#,
            r#""carrier":null,"name":"{first} {last}","phone":null,"tracking_number":null}},"#,
            r#""status":"{status}","transfer_group":null}}"#,
        ),
        id = id,
        amount = amount,
        secret = secret,
        created = created,
        currency = currency,
        customer = customer,
        order = order,
        items = items,
        plural = plural,
        charge = charge,
        run = run,
        call = call,
        method = method,
        first_l = first_l,
        last_l = last_l,
        email_n = email_n,
        city = city,
        house = house,
        street = street,
        line2 = line2,
        postal = postal,
        state = state,
        first = first,
        last = last,
        status = status,
    );
}

/// The response to a request for `path`, its objects numbered from the
/// shared counter.
fn respond(path: &str, counter: &AtomicU64) -> Response<Full<Bytes>> {
    let (status, count) = if path.starts_with("/small") {
        (StatusCode::CREATED, 1)
    } else if path.starts_with("/large") {
        (StatusCode::OK, LIST_LEN)
    } else {
        let mut response = Response::new(Full::new(Bytes::from_static(b"not found\n")));
        *response.status_mut() = StatusCode::NOT_FOUND;
        return response;
    };
    let first = counter.fetch_add(count, Ordering::Relaxed);
    let mut rng = SmallRng::seed_from_u64(first);
    let mut body = String::with_capacity(1300 * count as usize + 100);
    if count == 1 {
        payment_intent(&mut body, &mut rng, first);
    } else {
        body.push_str(r#"{"object":"list","data":["#);
        for i in first..first + count {
            if i != first {
                body.push(',');
            }
            payment_intent(&mut body, &mut rng, i);
        }
        body.push_str(r#"],"has_more":true,"url":"/v1/payment_intents"}"#);
    }
    let request_id = format!("req_{}", random_string(&mut rng, BASE62, 14));
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .header("request-id", request_id)
        .body(Full::new(Bytes::from(body)))
        .expect("a valid response")
}

fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 2 || args.len() > 3 {
        eprintln!("usage: api_upstream LISTEN_ADDR [START]");
        std::process::exit(2);
    }
    let listen: SocketAddr = args[1].parse()?;
    let start: u64 = match args.get(2) {
        Some(s) => s.parse()?,
        None => 0,
    };
    let counter = Arc::new(AtomicU64::new(start));
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(serve(listen, counter))
}

async fn serve(listen: SocketAddr, counter: Arc<AtomicU64>) -> Result<(), Error> {
    let listener = tokio::net::TcpListener::bind(listen).await?;
    loop {
        let (stream, _) = listener.accept().await?;
        stream.set_nodelay(true)?;
        let counter = counter.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request: Request<Incoming>| {
                let counter = counter.clone();
                async move {
                    let path = request.uri().path().to_owned();
                    // Read the body whole so the connection stays reusable.
                    let _ = request.into_body().collect().await;
                    Ok::<_, Infallible>(respond(&path, &counter))
                }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}
