// The NanGuard tab. TensorBoard loads this ES module in the tab's iframe and calls render().
// Plain modules, no build step, nothing from the network: everything is served by the plugin.

import * as api from './api.js';
import {actionChip, chip, clear, h, kindGroup, sampleSummary, unverified} from './dom.js';
import {incidentView} from './incident.js';
import {summaryColumn} from './summary.js';
import {timelineCard} from './timeline.js';

const PAGE = 50;
const MAX_SELECTED = 6;
// How often the tab looks for new incidents of a live run: TensorBoard's default reload interval,
// or localStorage['nanguard.pollSeconds'] (at least 1; 0 turns it off).
const POLL_SECONDS = pollSeconds();

function pollSeconds() {
  try {
    const stored = window.localStorage.getItem('nanguard.pollSeconds');
    if (stored !== null && stored.trim() !== '' && Number.isFinite(Number(stored))) {
      const seconds = Number(stored);
      return seconds <= 0 ? 0 : Math.max(1, seconds);
    }
  } catch (ignored) {} // storage unavailable (a sandboxed frame): the default
  return 30;
}

const state = {
  runs: [],
  selected: [],
  view: 'timeline',
  focusRun: null, // the run whose incident list is shown
  page: 0,
  open: null, // {run, index}
  lossTags: {},
};

let root;
let main;
let sidebar;


function setView(view) {
  state.view = view;
  for (const button of document.querySelectorAll('.tabs button')) {
    button.classList.toggle('active', button.dataset.view === view);
  }
  refresh();
}

function openIncident(run, index) {
  state.focusRun = run;
  state.open = {run, index};
  state.page = Math.floor(index / PAGE);
  setView('incidents');
}

function showError(where, error) {
  where.appendChild(h('p', {class: 'error'}, String(error.message || error)));
}

// ------------------------------------------------------------------ run selector

function runSelector() {
  const list = h('div', {class: 'run-list'});
  for (const run of state.runs) {
    const box = h('input', {type: 'checkbox', value: run.run, checked: state.selected.includes(run.run),
      onchange: (e) => {
        const set = new Set(state.selected);
        if (e.target.checked) set.add(run.run);
        else set.delete(run.run);
        state.selected = state.runs.map((r) => r.run).filter((name) => set.has(name));
        if (!state.selected.includes(state.focusRun)) state.focusRun = state.selected[0] || null;
        refresh();
      }});
    const warnings = run.precursors || 0;  // early warnings are not incidents: counted apart
    const counts = [h('span', {class: 'count', title: 'incidents'}, String(run.incidents - warnings))];
    if (warnings) counts.push(h('span', {class: 'count count-precursor', title: 'early warnings'}, `+${warnings}`));
    list.appendChild(h('label', {class: 'run', title: run.run}, box,
        h('span', {class: 'run-name'}, run.run), ...counts));
  }
  return h('div', {}, h('h4', {}, 'Runs'),
      state.runs.length ? list : h('p', {class: 'muted'}, 'No run with nanguard/events.jsonl.'));
}

// ------------------------------------------------------------------ views

async function renderTimeline(target) {
  if (!state.selected.length) return target.appendChild(h('p', {class: 'muted'}, 'Select a run.'));
  const data = await Promise.all(state.selected.map((run) => api.timeline(run, state.lossTags[run])));
  const ranges = data.map((d) => d.step_range).filter(Boolean);
  const stepRange = ranges.length ? [Math.min(...ranges.map((r) => r[0])), Math.max(...ranges.map((r) => r[1]))] : null;
  const width = Math.max(480, target.clientWidth - 34);
  for (const d of data) {
    target.appendChild(timelineCard(d, {
      width, stepRange, onOpen: openIncident,
      onLossTag: (run, tag) => {
        state.lossTags[run] = tag;
        refresh();
      },
    }));
  }
}

function incidentRow(run, event) {
  const index = event._dashboard.index;
  const samples = sampleSummary(event);
  const open = state.open && state.open.run === run && state.open.index === index;
  const kinds = (event.kinds || []).join(', ');
  return h('tr', {class: open ? 'incident-row open' : 'incident-row', dataset: {index},
    title: [event.source_line, event.culprit_op].filter(Boolean).join(' · '),
    onclick: () => {
      state.open = {run, index};
      refresh();
    }},
  h('td', {class: 'num'}, String(event.global_step)),
  h('td', {class: 'ellipsis'}, chip(kinds, kindGroup(event.kinds)), event.rank ? h('span', {class: 'muted small'}, ` r${event.rank}`) : null),
  h('td', {class: 'muted'}, event.cause || ''),
  h('td', {}, actionChip(event.action)),
  h('td', {class: unverified(event) ? 'mark-unverified ellipsis' : 'muted ellipsis', title: samples}, samples));
}

async function renderIncidents(target) {
  if (!state.selected.length) return target.appendChild(h('p', {class: 'muted'}, 'Select a run.'));
  if (!state.selected.includes(state.focusRun)) state.focusRun = state.selected[0];
  const run = state.focusRun;
  const {items, total} = await api.incidents(run, state.page * PAGE, PAGE);
  const pages = Math.max(1, Math.ceil(total / PAGE));
  const runPicker = state.selected.length > 1 ?
    h('select', {class: 'run-picker', onchange: (e) => {
      state.focusRun = e.target.value;
      state.page = 0;
      state.open = null;
      refresh();
    }}, state.selected.map((r) => h('option', {value: r, selected: r === run}, r))) :
    h('strong', {}, run);
  const pager = h('div', {class: 'pager'},
      h('button', {disabled: state.page === 0, onclick: () => {
        state.page -= 1;
        refresh();
      }}, '‹'),
      h('span', {}, total ? `${state.page * PAGE + 1}–${Math.min(total, (state.page + 1) * PAGE)} of ${total}` : '0 incidents'),
      h('button', {disabled: state.page >= pages - 1, onclick: () => {
        state.page += 1;
        refresh();
      }}, '›'));
  const table = h('table', {class: 'incident-list'},
      h('thead', {}, h('tr', {}, ['step', 'kinds', 'cause', 'action', 'samples'].map((c) => h('th', {}, c)))),
      h('tbody', {}, items.map((event) => incidentRow(run, event))));
  const listPane = h('div', {class: 'list-pane card'}, h('div', {class: 'card-head'}, runPicker, pager), table);
  const detailPane = h('div', {class: 'detail-pane'});
  target.appendChild(h('div', {class: 'incidents-layout'}, listPane, detailPane));
  if (!state.open || state.open.run !== run) {
    if (!items.length) return detailPane.appendChild(h('p', {class: 'muted'}, 'No incidents in this run.'));
    state.open = {run, index: items[0]._dashboard.index};
    listPane.querySelector('tbody tr').classList.add('open');
  }
  try {
    detailPane.appendChild(incidentView(run, await api.incident(run, state.open.index)));
  } catch (error) {
    showError(detailPane, error);
  }
}

async function renderSummary(target) {
  if (!state.selected.length) return target.appendChild(h('p', {class: 'muted'}, 'Select a run.'));
  const summaries = await Promise.all(state.selected.map((run) => api.summary(run)));
  target.appendChild(h('div', {class: 'summary-grid'}, summaries.map(summaryColumn)));
}

let generation = 0;

async function refresh() {
  const mine = ++generation;
  clear(sidebar).appendChild(runSelector());
  const target = h('div', {class: `view view-${state.view}`});
  const renderers = {timeline: renderTimeline, incidents: renderIncidents, summary: renderSummary};
  clear(main).appendChild(target);
  target.setAttribute('aria-busy', 'true');
  try {
    await renderers[state.view](target);
  } catch (error) {
    if (mine === generation) showError(target, error);
  }
  if (mine === generation) {
    target.setAttribute('aria-busy', 'false');
    root.dataset.ready = state.view;
  }
}

export async function render() {
  document.head.appendChild(h('link', {rel: 'stylesheet', href: './static/style.css'}));
  document.title = 'NanGuard';
  sidebar = h('aside', {class: 'sidebar'});
  main = h('main', {class: 'main'});
  const tabs = h('nav', {class: 'tabs'}, [['timeline', 'Timeline'], ['incidents', 'Incidents'], ['summary', 'Summary']]
      .map(([view, label]) => h('button', {dataset: {view}, class: view === state.view ? 'active' : '', onclick: () => setView(view)}, label)));
  root = h('div', {class: 'nanguard', id: 'nanguard'},
      h('header', {class: 'top'}, h('span', {class: 'brand'}, 'NanGuard'), tabs,
          h('button', {class: 'reload', onclick: () => load(),
            title: POLL_SECONDS ? `reload (new incidents also show by themselves: checked every ${POLL_SECONDS} s)` : 'reload'}, '⟳')),
      h('div', {class: 'body'}, sidebar, main));
  document.body.appendChild(root);
  let resizeTimer = null;
  window.addEventListener('resize', () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => state.view === 'timeline' && refresh(), 200);
  });
  await load();
  if (POLL_SECONDS) setInterval(poll, POLL_SECONDS * 1000);
}

/** What the run list shows: a change (a new run, a new incident) redraws the tab. */
function runsSignature(runs) {
  return runs.map((r) => `${r.run}:${r.incidents}`).join('|');
}

let polling = false;

/** Redraw when a run gained incidents (or a run appeared) since the tab last loaded; otherwise leave it. */
async function poll() {
  if (polling || document.visibilityState === 'hidden') return;
  polling = true;
  try {
    const runs = await api.runs();
    if (runsSignature(runs) !== runsSignature(state.runs)) await load(runs);
  } catch (ignored) {
    // a TensorBoard restarting or busy: keep what is shown, the next poll tries again
  } finally {
    polling = false;
  }
}

async function load(runs) {
  try {
    state.runs = runs || await api.runs();
  } catch (error) {
    clear(main);
    showError(main, error);
    return;
  }
  const names = state.runs.map((r) => r.run);
  state.selected = state.selected.filter((name) => names.includes(name));
  if (!state.selected.length) state.selected = names.slice(0, MAX_SELECTED);
  if (!state.focusRun || !names.includes(state.focusRun)) state.focusRun = state.selected[0] || null;
  await refresh();
}
