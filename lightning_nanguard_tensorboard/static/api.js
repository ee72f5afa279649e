// The plugin's routes, fetched relative to the iframe's base URL (/data/plugin/nanguard/).

function url(route, params) {
  const target = new URL(route, document.baseURI);
  for (const [key, value] of Object.entries(params || {})) {
    if (value !== null && value !== undefined) target.searchParams.set(key, String(value));
  }
  return target;
}

async function getJson(route, params) {
  const response = await fetch(url(route, params), {credentials: 'same-origin'});
  if (!response.ok) {
    let message = `${response.status} ${response.statusText}`;
    try {
      message = (await response.json()).error || message;
    } catch (ignored) {}
    throw new Error(`${route}: ${message}`);
  }
  return {body: await response.json(), headers: response.headers};
}

export async function runs() {
  return (await getJson('runs')).body;
}

/** One page of a run's incidents: {items, total}. */
export async function incidents(run, offset, limit) {
  const {body, headers} = await getJson('incidents', {run, offset, limit});
  return {items: body, total: Number(headers.get('X-Total-Count') || body.length)};
}

export async function incident(run, index) {
  return (await getJson('incident', {run, index})).body;
}

export async function timeline(run, lossTag) {
  return (await getJson('timeline', {run, loss_tag: lossTag})).body;
}

export async function summary(run) {
  return (await getJson('summary', {run})).body;
}

export function thumbnailUrl(run, index, position) {
  return url('thumbnail', {run, index, position}).toString();
}
